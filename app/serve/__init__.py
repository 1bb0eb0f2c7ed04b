"""The OpenAI-compatible server, its request parsing and metrics, and the client for remote
OpenAI-compatible engines.
"""
