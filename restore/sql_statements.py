"""A SQL text cut into its statements, for the columnar engine, which runs its plan a statement at a time (each
timed, and named in the error of the one that fails).

A ";" ends a statement only outside a string ('...', a quote inside it doubled), a quoted name ("..."), a line
comment (-- to the end of the line) and a block comment (/* ... */): a bound value or a comment may hold one.
A piece holding nothing but white space and comments is no statement (DuckDB refuses to run an empty one).
"""

from __future__ import annotations


class SqlTextError(ValueError):
    """The text ends inside a string, a quoted name or a block comment."""


def split_statements(sql: str) -> list[str]:
    """The statements of ``sql`` in order, each without its ";" and the white space around it (comments kept)."""
    statements: list[str] = []
    start = i = 0
    has_code = False  # the current piece holds more than white space and comments
    while i < len(sql):
        if sql.startswith("--", i):
            end = sql.find("\n", i)
            i = len(sql) if end < 0 else end + 1
            continue
        if sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            if end < 0:
                raise SqlTextError(f"SQL text ends inside a block comment opened at offset {i}")
            i = end + 2
            continue
        c = sql[i]
        if c in "'\"":
            # A doubled quote ('it''s') is read as this string's end and the next one's start: the same ";"s skipped.
            end = sql.find(c, i + 1)
            if end < 0:
                what = "a string" if c == "'" else "a quoted name"
                raise SqlTextError(f"SQL text ends inside {what} opened at offset {i}")
            has_code = True
            i = end + 1
            continue
        if c == ";":
            if has_code:
                statements.append(sql[start:i].strip())
            start, has_code = i + 1, False
        elif not c.isspace():
            has_code = True
        i += 1
    if has_code:
        statements.append(sql[start:].strip())
    return statements
