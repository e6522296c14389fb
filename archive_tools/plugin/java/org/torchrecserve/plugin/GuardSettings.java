package org.torchrecserve.plugin;

import java.io.File;
import java.util.HashMap;
import java.util.Map;
import org.pytorch.serve.archive.model.ModelArchive;
import org.pytorch.serve.archive.utils.ArchiveUtils;
import org.pytorch.serve.http.BadRequestException;
import org.pytorch.serve.wlm.Model;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * A model's guard settings: the {@code guard} section of its archive's model-config.yaml. Zero
 * (the default) derives the value from the model's measured batch time:
 *
 * <pre>
 * guard:
 *   max_queue_wait_ms: 0   # 0: four times the batch time, at least 100 ms
 *   hang_after_ms: 0       # 0: 20 times the batch time, at least 2000 ms
 *   drain_timeout_s: 30    # how long a scale-down or unregister waits for running batches
 * </pre>
 *
 * A register call may override each of them with a query parameter of the same name.
 */
record GuardSettings(long maxQueueWaitMs, long hangAfterMs, long drainTimeoutS) {
    static final GuardSettings DEFAULTS = new GuardSettings(0, 0, 30);
    private static final Logger logger = LoggerFactory.getLogger(GuardSettings.class);

    static final String MAX_QUEUE_WAIT = "max_queue_wait_ms";
    static final String HANG_AFTER = "hang_after_ms";
    static final String DRAIN_TIMEOUT = "drain_timeout_s";
    static final String[] KEYS = {MAX_QUEUE_WAIT, HANG_AFTER, DRAIN_TIMEOUT};

    /** The archive's settings, each replaced by ``overrides`` where it names the key. */
    static GuardSettings of(Model model, Map<?, ?> overrides) {
        Map<Object, Object> merged = new HashMap<>(archiveSection(model));
        merged.putAll(overrides);
        return new GuardSettings(
                number(merged, MAX_QUEUE_WAIT, DEFAULTS.maxQueueWaitMs),
                number(merged, HANG_AFTER, DEFAULTS.hangAfterMs),
                number(merged, DRAIN_TIMEOUT, DEFAULTS.drainTimeoutS));
    }

    private static Map<?, ?> archiveSection(Model model) {
        ModelArchive archive = model.getModelArchive();
        String name = archive.getManifest().getModel().getConfigFile();
        if (name == null) {
            return Map.of();
        }
        try {
            Map<String, Object> config = ArchiveUtils.readYamlFile(new File(archive.getModelDir(), name));
            Object section = config == null ? null : config.get("guard");
            return section instanceof Map<?, ?> guard ? guard : Map.of();
        } catch (Exception e) { // a bad section must not stop the model: defaults, and say so
            logger.warn("model {}: guard settings unreadable, using defaults: {}", model.getModelName(), e.getMessage());
            return Map.of();
        }
    }

    private static long number(Map<?, ?> section, String key, long fallback) {
        Object value = section.get(key);
        if (value == null) {
            return fallback;
        }
        try {
            long number = value instanceof Number n ? n.longValue() : Long.parseLong(value.toString());
            if (number >= 0) {
                return number;
            }
        } catch (NumberFormatException e) {
            // refused below
        }
        throw new BadRequestException("guard." + key + ": must be a whole number >= 0, got '" + value + "'");
    }
}
