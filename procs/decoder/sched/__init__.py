"""The scheduling core (paper Alg. 3): the loop, the policies, the cache manager, the slot
table, the speculation gate and the acceptance rule. Pure logic, shared with the simulator;
it imports nothing of forward/ or drafts/.
"""
