"""Replay simulator: the runtime's policies over acceptance tables with a measured cost model."""
