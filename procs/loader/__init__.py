"""Loader process (streams draft weights into slots); see issue 4."""
