package org.torchrecserve.plugin;

/**
 * The archive files the plugin reads or writes, by name: the same names as the Python side's
 * {@code handlers/runtime/archive_files.py}, which a test checks this file against.
 */
final class ArchiveFiles {
    static final String MANIFEST = "MAR-INF/MANIFEST.json";
    static final String MODEL_CONFIG = "model-config.yaml";
    static final String TABLES = "tables.json";
    static final String LOG_POINTER = "freshness-log.json";
    static final String MAILBOX = "freshness-calls";
    static final String REFUSED = "refused.json";

    private ArchiveFiles() {}
}
