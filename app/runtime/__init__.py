"""The surfaces' runtime: how the UI and the server run the core's work (the process's one
compute thread, and, with batched streams, the scheduler). The core (app/core) knows none of
it."""
