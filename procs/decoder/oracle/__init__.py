"""What the future-knowing policies and the cost model need: acceptance tables and their
files, exact replay, load planning, and the costs calibrated on this machine.
"""
