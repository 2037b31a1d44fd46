"""Commands that plugins add to ``tmetrics``, found through the entry-point group
``tmetrics.commands`` (each entry a ``click.Command``) and imported only when named or listed,
so core never imports a plugin and a broken plugin breaks only its own command. Core commands
whose module imports torch are lazy too, listed with a short help given here, so that
``tmetrics --help`` answers without importing torch."""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import click

__all__ = ["COMMANDS_GROUP", "PluginGroup"]

COMMANDS_GROUP = "tmetrics.commands"


class PluginGroup(click.Group):
    """A ``click.Group`` whose commands are its own, the ``lazy`` ones (name -> ``("module:attr",
    short help)``, imported when run) and those of ``tmetrics.commands``."""

    def __init__(self, *args: Any, lazy: dict[str, tuple[str, str]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def _plugins(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMANDS_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy) | set(self._plugins()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        own = super().get_command(ctx, cmd_name)
        if own is not None:
            return own
        if cmd_name in self.lazy:
            module, _, attr = self.lazy[cmd_name][0].partition(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        entry = self._plugins().get(cmd_name)
        return entry.load() if entry is not None else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list, with the lazy commands' short help read from ``lazy``."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names), default=0)
        rows = []
        for name in names:
            if name in self.lazy and name not in self.commands:
                rows.append((name, click.Command(name, help=self.lazy[name][1]).get_short_help_str(limit)))
                continue
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
