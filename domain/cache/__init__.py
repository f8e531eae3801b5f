"""Prefix-cache policy: which cached prefix serves a prompt, what to evict, where to take snapshots."""

from mlx_dspark.domain.cache.prefix_index import CacheEntry, InsertResult, Match, PrefixIndex, StoredPrefix
from mlx_dspark.domain.cache.snapshots import common_prefix, snapshot_points

__all__ = ["CacheEntry", "InsertResult", "Match", "PrefixIndex", "StoredPrefix", "common_prefix", "snapshot_points"]
