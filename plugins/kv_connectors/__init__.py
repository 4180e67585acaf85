"""In-tree KV-connector plugins (the `pagedllm.kv_connectors` kind): stores of KV blocks beyond the device pool."""
