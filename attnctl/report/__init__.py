"""What each view shows, as plain data that every renderer only reads: the reports of
``run`` and ``memory`` (``commands``) and of generation and translation (``generation``)."""
