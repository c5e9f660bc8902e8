"""Processes of the runtime, each named for its one job."""
