"""pagedllm's in-tree plugins. Each is found through the entry points in pyproject.toml, like any other."""
