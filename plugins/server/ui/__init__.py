"""The web UI `pagedllm serve` ships at `/`: a chat page and the live engine dashboard (docs/web-ui.md).

Static files (static/: no CDN, no build step) plus one event stream of the engine core's snapshots
(feed.py); routes.py wires them into the app. Off with `--no-ui` (or `plugins.openai.ui: false`).
"""
