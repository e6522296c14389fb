package org.torchrecserve.plugin;

import org.pytorch.serve.util.ConfigManager;
import org.pytorch.serve.wlm.Model;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * The TorchServe this plugin is built against, checked when TorchServe loads the plugin (each
 * endpoint's constructor): another version is refused with a message naming both, and the
 * internals the plugin reaches into ({@link Internals}) are looked up now, so that one missing
 * stops the server at start, by name, rather than failing its first registration.
 *
 * <p>A refusal stops TorchServe's start (it exits, printing the message). {@code
 * archive_tools/plugin.py} reads {@link #TORCHSERVE} and refuses to build the jar against another
 * TorchServe, and {@code tests/test_torchserve_contracts.py} runs {@link #main} on the installed one.
 */
final class Contract {
    static final String TORCHSERVE = "0.12.0";
    private static final Logger logger = LoggerFactory.getLogger(Contract.class);
    private static volatile boolean checked;

    private Contract() {}

    /** Refuses to run on a TorchServe the plugin was not built against. */
    static synchronized void require() {
        if (checked) {
            return;
        }
        String problem = problem(ConfigManager.getInstance().getVersion());
        if (problem != null) {
            logger.error(problem);
            throw new IllegalStateException(problem);
        }
        checked = true;
    }

    /** Why the plugin cannot run on TorchServe {@code running}, or null. */
    static String problem(String running) {
        if (!TORCHSERVE.equals(running)) {
            return "torchrec-serve plugin: built for TorchServe " + TORCHSERVE + ", this server runs " + running
                    + "; install torchserve==" + TORCHSERVE + " (or a torchrec-serve built for " + running + ")";
        }
        try {
            Internals.check();
            Object dataQueue = Model.class.getField("DEFAULT_DATA_QUEUE").get(null);
            if (!Internals.DATA_QUEUE.equals(dataQueue)) { // compiled into the plugin as a constant
                return "torchrec-serve plugin: TorchServe's Model.DEFAULT_DATA_QUEUE is " + dataQueue
                        + ", the plugin was compiled with " + Internals.DATA_QUEUE;
            }
        } catch (ReflectiveOperationException | IllegalStateException | ExceptionInInitializerError e) {
            Throwable cause = e instanceof ExceptionInInitializerError ? e.getCause() : e;
            return "torchrec-serve plugin: TorchServe " + running + " lacks what the plugin relies on: " + cause.getMessage();
        }
        return null;
    }

    /** {@code java -cp model-server.jar:plugin.jar org.torchrecserve.plugin.Contract [VERSION]}. */
    public static void main(String[] args) {
        String problem = problem(args.length > 0 ? args[0] : TORCHSERVE);
        System.out.println(problem == null ? "ok" : problem);
        System.exit(problem == null ? 0 : 1);
    }
}
