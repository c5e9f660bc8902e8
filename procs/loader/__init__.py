"""Loader process (streams draft weights into slots); see issue 4.

``main`` is the process (sockets, FIFO queue, heartbeats, Cancel), ``job`` validates and
runs one load, ``reader`` does cold chunked reads, ``pacing`` is the edge-emulated token
bucket. Slot memory itself lives in :mod:`memspec.common.slotmem`.
"""
