# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the three modules share: options for finding the tools, and turning engine errors into fail_json."""
from __future__ import annotations

from .errors import GpuCkptError

TOOL_ARGS = dict(
    criu_path=dict(type="path"),
    criu_options=dict(type="list", elements="str", default=[]),
    libcuda_path=dict(type="path"),
)

PROGRESS_ARGS = dict(
    progress_file=dict(type="path"),  # set by the action plugin of the same name (plugins/action)
)


MIGRATION_ARGS = dict(
    migration_id=dict(type="str"),
    journal_dir=dict(type="path", default="/var/lib/gpuckpt/journal"),
)


def journal_for(params, role):
    """The migration journal for this host's role, or None outside a migration."""
    if not params.get("migration_id"):
        return None
    from .migration import Journal
    return Journal(params["journal_dir"], params["migration_id"], role)


def run_engine(module, fn, *args, **kwargs):
    """Call an engine function; exit_json with its result, or fail_json with an error for people."""
    try:
        result = fn(*args, **kwargs)
    except GpuCkptError as exc:
        module.fail_json(**exc.to_dict())
    except Exception as exc:  # noqa: BLE001 - an engine bug must still reach the user as a failure
        import traceback
        module.fail_json(msg="gpuckpt engine error: %s" % exc, exception=traceback.format_exc())
    module.exit_json(**result)
