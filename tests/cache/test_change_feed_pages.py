"""A catch-up's steps (cache/change_feed.py `ChangeFeed.step`): a page shorter than `page` is the log's end, so a
catch-up of a few changes is one step (it took two: the second only to read an empty page, a queue wait later), while
a full page, or a reset, leaves it to a next step."""

from __future__ import annotations

from cache.change_feed import Change, ChangeFeed


class Log:
    """A change log: its changes after a cursor, `limit` at most a read, as the stores answer."""

    def __init__(self, changes: list[Change]) -> None:
        self.changes = changes
        self.reads = 0

    def change_cursor(self) -> str:
        return "0"

    def changes_since(self, cursor: str, limit: int = 1000) -> tuple[str, list[Change]]:
        self.reads += 1
        after = int(cursor)
        page = self.changes[after:after + limit]
        return str(after + len(page)), page


def puts(n: int) -> list[Change]:
    return [("put", f"e{i}", "p") for i in range(n)]


def feed_of(log: Log, page: int) -> ChangeFeed:
    feed = ChangeFeed(log, interval_s=60.0)  # type: ignore[arg-type]
    feed.page = page
    return feed


def test_a_short_page_ends_the_catch_up_in_one_step() -> None:
    log, applied = Log(puts(5)), []
    feed = feed_of(log, page=10)
    assert feed.step(applied.extend) == (5, True)
    assert log.reads == 1 and len(applied) == 5 and feed.recent()


def test_a_full_page_leaves_the_rest_to_the_next_step() -> None:
    log, applied = Log(puts(25)), []
    feed = feed_of(log, page=10)
    assert feed.step(applied.extend) == (10, False)
    assert feed.step(applied.extend) == (10, False)
    assert feed.step(applied.extend) == (5, True)
    assert applied == puts(25)


def test_a_reset_is_never_the_logs_end() -> None:
    log, applied = Log([("reset", "", "")]), []
    feed = feed_of(log, page=10)
    assert feed.step(applied.extend) == (1, False)  # the reload's cursor may have more after it: read again
    assert feed.step(applied.extend) == (0, True)
