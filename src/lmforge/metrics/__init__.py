"""Measurements more than one stage makes: held-out perplexity and bits per byte (quantize_int8's accuracy gate and
evaluate), decode latency and throughput (evaluate and the serving benchmark)."""
