"""The serve command's replica flags: refused before anything starts when they make no sense."""

from oscar_compile.cli.serve import main


def test_ray_address_needs_replicas(capsys):
    assert main(["--device", "cpu", "--ray-address", "auto"]) == 2
    assert "--ray-address needs --replicas" in capsys.readouterr().err


def test_replicas_must_be_positive(capsys):
    assert main(["--device", "cpu", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_bad_server_flags_are_refused_before_ray_starts(capsys):
    assert main(["--device", "cpu", "--replicas", "2", "--chat-template", "/nonexistent.jinja"]) == 2
    assert "no such file" in capsys.readouterr().err
