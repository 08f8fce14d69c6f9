"""``agentrl view``: one self-contained static HTML file to browse trajectories offline (no server, no CDN).

Imports neither torch nor transformers.
"""

from agentrl.viewer.html import build_payload, load_view_items, write_html

__all__ = ["build_payload", "load_view_items", "write_html"]
