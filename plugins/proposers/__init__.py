"""In-tree speculative-decoding proposers: `ngram` (prompt lookup) and `draft` (a smaller model)."""
