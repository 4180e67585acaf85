"""In-tree tool-call parsers, one package each: `hermes`, `llama3_json`, `mistral`, `pythonic`."""
