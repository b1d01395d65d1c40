"""Step caching inside step-level batching: per-request first_block / teacache / taylorseer."""

from ...common.cache_policy import POLICIES, CacheBounds, CachePolicy, CachePolicyError, parse_cache

__all__ = ["POLICIES", "CacheBounds", "CachePolicy", "CachePolicyError", "parse_cache"]
