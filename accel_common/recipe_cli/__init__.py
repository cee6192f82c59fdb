"""A recipe's command line: the settings every recipe shares (options), a Settings class as flags
(command_line), the training command (command), --dry-run's plan (dry_run), and the entry point
(entry).
"""
