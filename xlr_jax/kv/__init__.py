"""The paged KV cache on the host: pages and the page pool, the prefix cache, the tier store."""
