"""Progress bars draw only on rank 0, on a terminal, unless QRL_NO_PROGRESS=1."""
import io

from megatron_qrl.logging import progress_bar, progress_enabled


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_enabled_only_on_rank0_tty():
    assert progress_enabled(0, _Tty(), env={})
    assert not progress_enabled(1, _Tty(), env={})
    assert not progress_enabled(0, io.StringIO(), env={})
    assert not progress_enabled(0, _Tty(), env={"QRL_NO_PROGRESS": "1"})
    assert progress_enabled(0, _Tty(), env={"QRL_NO_PROGRESS": "0"})


def test_bar_draws_on_tty(monkeypatch):
    monkeypatch.delenv("QRL_NO_PROGRESS", raising=False)
    out = _Tty()
    with progress_bar(total=3, desc="rl steps", file=out) as bar:
        for _ in range(3):
            bar.update(1)
            bar.set_postfix(reward=0.5)
    assert "rl steps" in out.getvalue() and "3/3" in out.getvalue()


def test_disabled_bar_is_silent_passthrough(monkeypatch):
    monkeypatch.setenv("QRL_NO_PROGRESS", "1")
    out = _Tty()
    assert list(progress_bar(range(4), file=out)) == [0, 1, 2, 3]
    bar = progress_bar(total=2, rank=0, file=out)
    bar.update(1)
    bar.set_postfix(loss=1.0)
    bar.close()
    assert out.getvalue() == ""
