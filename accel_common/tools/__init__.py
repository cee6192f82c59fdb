"""What the `accel-recipes` command runs and no recipe imports: plan, convert, new, make-data,
doctor and bench. A copied recipe needs none of it."""
