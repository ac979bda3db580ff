"""Every model one server serves: names to files (`directory`), loading one (`open_model`), and the
resident runtimes (`residents`)."""
