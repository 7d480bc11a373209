"""Plot writers: each turns the numbers a task's pure functions return into a figure."""
