"""In-tree reasoning parsers: `deepseek_r1` and `qwen3` (`<think>...</think>`), in the `think` package."""
