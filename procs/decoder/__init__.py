"""Decoder process: owns the accelerator context, target, draft slots, KV caches and the SD hot loop."""
