"""A SQL text cut into its statements (restore.sql_statements), as the columnar engine runs its plan: a ";" inside
a string, a quoted name or a comment ends no statement; a text ending inside one is refused with a clear error."""

from __future__ import annotations

import duckdb
import pytest

from restore import engine_columnar
from restore.sql_statements import SqlTextError, split_statements


def test_statements_are_cut_at_each_semicolon_and_trimmed() -> None:
    assert split_statements("CREATE TABLE a (x INT);\n  INSERT INTO a VALUES (1) ;SELECT 1") == [
        "CREATE TABLE a (x INT)", "INSERT INTO a VALUES (1)", "SELECT 1"]


def test_a_piece_of_nothing_but_white_space_and_comments_is_no_statement() -> None:
    assert split_statements(" ;\n; -- a note\n;/* another */;SELECT 1;\n-- the end\n") == ["SELECT 1"]
    assert split_statements("") == []


@pytest.mark.parametrize(("sql", "want"), [
    ("SELECT 'a;b'; SELECT 2", ["SELECT 'a;b'", "SELECT 2"]),
    ("SELECT 'it''s; here'; SELECT 2", ["SELECT 'it''s; here'", "SELECT 2"]),
    ('SELECT 1 AS "a;b"; SELECT 2', ['SELECT 1 AS "a;b"', "SELECT 2"]),
    ("SELECT 1 -- one; two\n; SELECT 2", ["SELECT 1 -- one; two", "SELECT 2"]),
    ("SELECT /* one; two */ 1; SELECT 2", ["SELECT /* one; two */ 1", "SELECT 2"]),
    ("-- the first's note; it says so\nSELECT 1; SELECT '--;'", ["-- the first's note; it says so\nSELECT 1",
                                                                "SELECT '--;'"]),
], ids=["string", "doubled-quote", "quoted-name", "line-comment", "block-comment", "quote-in-a-comment"])
def test_a_semicolon_inside_a_string_a_name_or_a_comment_ends_no_statement(sql: str, want: list[str]) -> None:
    assert split_statements(sql) == want


@pytest.mark.parametrize(("sql", "what"), [
    ("SELECT 'a;b", "a string opened at offset 7"),
    ('SELECT 1 AS "a', "a quoted name opened at offset 12"),
    ("SELECT 1 /* a; b", "a block comment opened at offset 9"),
])
def test_a_text_ending_inside_a_string_a_name_or_a_comment_is_refused(sql: str, what: str) -> None:
    with pytest.raises(SqlTextError, match=f"^SQL text ends inside {what}$"):
        split_statements(sql)


def test_the_engine_runs_each_statement_of_a_text_whose_values_and_comments_hold_semicolons() -> None:
    """DuckDB, a statement at a time as the columnar plan runs (each timed under the table it makes): a bound
    value and a comment with a ";" in them are parts of their statements."""
    con = duckdb.connect()
    timings: dict[str, float] = {}
    engine_columnar._execute(con, "CREATE TABLE t AS SELECT 'a;b' AS x; -- t holds one row; no more\n"
                                  "INSERT INTO t SELECT x || ';c' FROM t;", timings)
    assert sorted(r[0] for r in con.execute("SELECT x FROM t").fetchall()) == ["a;b", "a;b;c"]
    assert set(timings) == {"t", "insert"}
    con.close()
