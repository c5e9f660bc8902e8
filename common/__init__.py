"""Shared by more than one process: config, errors, paths, metrics, tensor layouts."""
