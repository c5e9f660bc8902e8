"""Entry points: the memspec CLI and (later) the supervisor."""
