"""Example pagedllm plugins. The entry points name `registration`, which imports nothing heavy."""
