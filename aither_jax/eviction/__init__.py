"""Layer 3: which KV pages leave the device first (the eviction policies and, to come, the graph
advisor that keeps identity and system blocks resident)."""
