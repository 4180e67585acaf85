"""pagedllm's in-tree command plugins: `pagedllm` subcommands beyond the built-in ones."""
