"""gradleak on Flower: a defended ClientApp and an audited ServerApp (see README.md)."""
