"""Drafters that need no array library of their own: prompt lookup, the draft model over any
backend's session, and tokenizer pairing checks.
"""
