"""tests/sessions.py: the README's test command runs every test file once, in sessions."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from tests import sessions


def test_every_test_file_runs_in_exactly_one_session():
    files = sessions.test_files()
    groups = sessions.sessions(files)
    ran = [f for group in groups for f in group]
    assert sorted(ran) == files and len(set(ran)) == len(ran)
    assert len(groups) == sessions.APPLY_SESSIONS + 1
    assert all(f.startswith("tests/apply/") for group in groups[:-1] for f in group)
    assert "tests/test_sessions.py" in groups[-1]


def test_junit_flags_are_taken_out_and_the_sessions_results_merged(tmp_path):
    assert sessions.split_junit(["-q", "--junitxml=a.xml", "-x"]) == (["-q", "-x"], "a.xml")
    assert sessions.split_junit(["--junit-xml", "b.xml", "-k", "t"]) == (["-k", "t"], "b.xml")
    assert sessions.split_junit(["-q"]) == (["-q"], None)
    parts = []
    for k, tests in enumerate((3, 5)):
        part = tmp_path / f"j.xml.session{k}"
        part.write_text(f'<testsuites><testsuite name="pytest" tests="{tests}" failures="0" '
                        'errors="0" skipped="1"/></testsuites>', encoding="utf-8")
        parts.append(str(part))
    sessions.merge_junit(parts, str(tmp_path / "j.xml"))
    root = ET.parse(tmp_path / "j.xml").getroot()
    assert root.tag == "testsuites" and [s.get("tests") for s in root] == ["3", "5"]
    assert not any(p.name.endswith(("session0", "session1")) for p in tmp_path.iterdir())
