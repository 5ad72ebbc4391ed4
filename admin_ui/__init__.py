"""The admin web UI at /admin/ui: server-rendered pages over the admin API's services,
with a session cookie from an admin key and CSRF tokens on every change."""

from admin_ui.mount import UPLOAD_PATHS, install

__all__ = ["UPLOAD_PATHS", "install"]
