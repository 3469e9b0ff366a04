"""fastfold."""
