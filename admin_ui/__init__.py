"""The admin web UI at /admin/ui: server-rendered pages over the admin API's services,
with a session cookie from an admin key and CSRF tokens on every change.

The service finds it by its entry point (group "loraplex.mounts" in pyproject.toml), as
`MOUNT`: the app itself never imports it."""

from admin_ui.mount import MOUNT, UPLOAD_PATHS, install

__all__ = ["MOUNT", "UPLOAD_PATHS", "install"]
