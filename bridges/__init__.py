"""Bridges between runtimes: mx.array <-> torch, and embed/lm-head callbacks from verifier weights."""
