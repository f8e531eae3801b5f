"""Reference acceptance rules (greedy and speculative sampling); adapters' fast paths are pinned to them."""
