package org.torchrecserve.plugin;

import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.io.File;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.zip.ZipEntry;
import java.util.zip.ZipFile;

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

    /** The {@code model} section of an archive's manifest (a .mar or a folder), or null. */
    static JsonObject manifestModel(File entry) {
        String path = MANIFEST;
        try {
            String text;
            if (entry.isDirectory()) {
                text = Files.readString(new File(entry, path).toPath());
            } else {
                try (ZipFile zip = new ZipFile(entry)) {
                    ZipEntry manifest = zip.getEntry(path);
                    if (manifest == null) {
                        return null;
                    }
                    try (InputStream in = zip.getInputStream(manifest)) {
                        text = new String(in.readAllBytes(), StandardCharsets.UTF_8);
                    }
                }
            }
            return JsonParser.parseString(text).getAsJsonObject().getAsJsonObject("model");
        } catch (Exception e) {
            return null;
        }
    }
}
