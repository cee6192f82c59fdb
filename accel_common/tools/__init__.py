"""What the `accel-recipes` command runs and no recipe imports: plan, convert, new, make-data
(example_data), doctor, bench, launch, and free_port (ports) for their launches. A copied recipe
needs none of it."""
