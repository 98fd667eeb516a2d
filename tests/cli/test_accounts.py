"""The servers' system account when two hubs (or two test processes) create it at the same moment."""

from __future__ import annotations

import pwd
import stat

from hubext.cli import accounts


def test_an_account_created_by_another_process_meanwhile_is_used_not_refused(tmp_path, monkeypatch):
    """`useradd` fails with 9 ("username already in use") because another `up` made the account
    between our look-up and our useradd: that account is the one we wanted."""
    fake = tmp_path / "useradd"
    fake.write_text("#!/bin/sh\necho \"useradd: user 'elastic-gpu' already exists\" >&2\nexit 9\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    made = pwd.struct_passwd(("elastic-gpu", "x", 999, 999, "", str(tmp_path / "home"), "/usr/sbin/nologin"))
    looked = []

    def getpwnam(name: str) -> pwd.struct_passwd:
        looked.append(name)
        if len(looked) == 1:  # before our useradd: not there yet
            raise KeyError(name)
        return made

    monkeypatch.setattr(accounts.pwd, "getpwnam", getpwnam)
    assert accounts.ensure_team_account(tmp_path / "home") == made
