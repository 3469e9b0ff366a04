"""Input side of `suite fold`: parsers, tool runners, MSA and template features, the processed batch."""
