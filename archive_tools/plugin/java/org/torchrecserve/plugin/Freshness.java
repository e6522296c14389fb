package org.torchrecserve.plugin;

import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.io.File;
import java.io.IOException;
import java.nio.channels.FileChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.nio.file.StandardOpenOption;
import java.util.Map;
import org.pytorch.serve.archive.utils.ArchiveUtils;
import org.pytorch.serve.util.ConfigManager;

/**
 * Where a model's delta log lives, and writing to it durably.
 *
 * <p>The log of a served archive is {@code <model store>/deltas/<model>/<base>/log/<sequence>.delta}
 * ({@code base}: the first 16 hex digits of the archive's fingerprint, from its {@code
 * tables.json}): it survives restarts, and an archive with other weights starts a log of its own.
 * The plugin names the log in the model's extracted folder ({@code freshness-log.json}) when it
 * registers the model, before any worker loads, so that every worker replays it at load.
 */
final class Freshness {
    private Freshness() {}

    static File deltasDir() {
        return new File(ConfigManager.getInstance().getModelStore(), "deltas").getAbsoluteFile();
    }

    /** The archive's log folder, or null when the archive has no table layout (built before). */
    static File logDir(String modelName, File modelDir) {
        File layout = new File(modelDir, ArchiveFiles.TABLES);
        if (!layout.isFile()) {
            return null;
        }
        try {
            JsonObject parsed = JsonParser.parseString(Files.readString(layout.toPath())).getAsJsonObject();
            String base = parsed.get("fingerprint").getAsString().substring(0, 16);
            return new File(new File(new File(deltasDir(), modelName), base), "log");
        } catch (IOException | RuntimeException e) {
            return null;
        }
    }

    /**
     * Why a model has no delta log (its {@code logDir} is null), for a 409: a distributed layout's
     * dense archive holds no tables (its shards do); any other archive was built before tables.json.
     */
    static String whyNoLog(File modelDir) {
        try {
            Map<String, Object> config = ArchiveUtils.readYamlFile(new File(modelDir, ArchiveFiles.MODEL_CONFIG));
            Object handler = config == null ? null : config.get("handler");
            if (handler instanceof Map<?, ?> section && "remote".equals(section.get("artifact"))) {
                return "serves the dense part of a distributed layout and holds no tables: its embedding shards do;"
                        + " publish row deltas to the shards (torchrec-serve delta on this archive writes one per shard)";
            }
        } catch (Exception e) { // unreadable (TorchServe's reader throws its own checked kinds)
            // the general answer below
        }
        return "has no " + ArchiveFiles.TABLES + ": rebuild its archive with this version to publish deltas";
    }

    /**
     * Names the log in the model's folder (before its workers load), and empties its mailbox of
     * what an earlier registration left (a refusal, a call a stopped worker had taken).
     */
    static void writePointer(String modelName, File modelDir) throws IOException {
        File log = logDir(modelName, modelDir);
        if (log == null) {
            return;
        }
        File[] left = new File(modelDir, ArchiveFiles.MAILBOX).listFiles();
        for (File file : left == null ? new File[0] : left) {
            Files.deleteIfExists(file.toPath());
        }
        String json = Replies.COMPACT.toJson(Map.of("log", log.getPath()));
        Files.writeString(new File(modelDir, ArchiveFiles.LOG_POINTER).toPath(), json, StandardCharsets.UTF_8);
    }

    /** Copies {@code delta} into the log as {@code sequence}, on disk before it returns. */
    static File append(File delta, File log, long sequence) throws IOException {
        Files.createDirectories(log.toPath());
        Path target = new File(log, String.format("%08d.delta", sequence)).toPath();
        Path staged = new File(log, String.format(".%08d.delta.partial", sequence)).toPath();
        Files.copy(delta.toPath(), staged, StandardCopyOption.REPLACE_EXISTING);
        try (FileChannel file = FileChannel.open(staged, StandardOpenOption.WRITE)) {
            file.force(true);
        }
        Files.move(staged, target, StandardCopyOption.ATOMIC_MOVE);
        try (FileChannel dir = FileChannel.open(log.toPath(), StandardOpenOption.READ)) {
            dir.force(true); // the rename itself
        }
        return target.toFile();
    }
}
