"""What specdeck knows about models: the catalogue of pairs, the planner's choices and memory
fit, launch recipes for other engines, and where the shipped files live.
"""
