"""`specdeck bench`: interleaved runs, the prompt sets and the report.
"""
