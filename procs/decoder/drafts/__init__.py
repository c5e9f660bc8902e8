"""The draft kinds the engine runs beside the target: EAGLE-style heads, datastores, the
context lookup, and how far the lookup proposes.
"""
