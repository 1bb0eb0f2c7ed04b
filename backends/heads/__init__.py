"""Drafting heads written once over the array adapter (backends/arrays), and what they read
from head folders; no array library is imported here."""
