package org.torchrecserve.plugin;

import com.google.gson.JsonObject;
import com.google.gson.JsonParser;
import java.io.File;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.StandardCopyOption;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.TimeUnit;
import org.pytorch.serve.http.ConflictStatusException;
import org.pytorch.serve.http.InternalServerException;
import org.pytorch.serve.http.RequestTimeoutException;
import org.pytorch.serve.wlm.Model;

/**
 * The plugin's side of the freshness protocol (the workers' side is {@code
 * handlers/runtime/freshness/protocol.py}; a test checks that both spell it alike): a call is
 * written whole into the model's mailbox folder, one of the model's workers claims it and writes
 * its reply beside it. The calls never travel with inference requests, so no client can send one.
 *
 * <p>A reply carries the status the worker chose ({@code protocol.py} maps its errors to status
 * codes, once) and either the reply or the error body, passed on as they are.
 */
final class FreshnessCalls {
    static final int PROTOCOL = 1;
    static final String CALL = ".call";
    static final String REPLY = ".reply";
    private static final long POLL_MS = 5;

    /** A worker's answer: the status it chose, and the reply (200) or error body to send on. */
    record Answer(int status, JsonObject body) {}

    private FreshnessCalls() {}

    /** Is {@code delta} the log's next (or a duplicate of one in it), and whole? */
    static Answer check(Model model, File delta) throws Exception {
        return call(model, Map.of("op", "check", "delta", delta.getPath()));
    }

    /** The tables as they were after delta {@code to}: asked for, carried out by the writer. */
    static Answer rollback(Model model, long to) throws Exception {
        return call(model, Map.of("op", "rollback", "to", to));
    }

    /** The applied sequence, the log's head, rows applied and the workers' notes. */
    static Answer state(Model model) throws Exception {
        return call(model, Map.of("op", "state"));
    }

    /** Sends {@code call} (its {@code op} and arguments) to the model's workers, and waits. */
    private static Answer call(Model model, Map<String, Object> call) throws Exception {
        File box = new File(model.getModelDir(), ArchiveFiles.MAILBOX);
        Files.createDirectories(box.toPath());
        String id = UUID.randomUUID().toString();
        File request = new File(box, id + CALL);
        File reply = new File(box, id + REPLY);
        Map<String, Object> message = new LinkedHashMap<>();
        message.put("protocol", PROTOCOL);
        message.putAll(call);
        File staged = new File(box, id + CALL + ".partial");
        Files.writeString(staged.toPath(), Replies.COMPACT.toJson(message), StandardCharsets.UTF_8);
        Files.move(staged.toPath(), request.toPath(), StandardCopyOption.ATOMIC_MOVE);
        long timeoutS = Math.max(1, model.getResponseTimeout());
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(timeoutS);
        while (!reply.isFile()) {
            File refused = new File(box, ArchiveFiles.REFUSED);
            if (refused.isFile() && request.delete()) { // unclaimed, and no worker of this archive will
                throw new ConflictStatusException(Guard.label(model) + ": " + field(read(refused), "message"));
            }
            long now = System.nanoTime();
            if (now > deadline && request.delete()) { // unclaimed: taken back
                throw new RequestTimeoutException(Guard.label(model) + ": no worker took the freshness call within "
                        + timeoutS + " s (responseTimeout); are its workers still loading?");
            }
            // once claimed, the reply is awaited longer (the worker may be checking a large delta), not for ever
            if (now > deadline + TimeUnit.SECONDS.toNanos(timeoutS)) {
                throw new RequestTimeoutException(Guard.label(model) + ": a worker took the freshness call and did not "
                        + "answer within " + 2 * timeoutS + " s (did it stop?); the call may be made again");
            }
            Thread.sleep(POLL_MS);
        }
        JsonObject answer = read(reply);
        Files.deleteIfExists(reply.toPath());
        if (!answer.has("protocol") || answer.get("protocol").getAsInt() != PROTOCOL) {
            throw new InternalServerException(Guard.label(model) + ": its worker speaks freshness protocol "
                    + answer.get("protocol") + ", this plugin " + PROTOCOL);
        }
        int status = answer.get("status").getAsInt();
        return new Answer(status, answer.getAsJsonObject(status == 200 ? "reply" : "error"));
    }

    private static JsonObject read(File file) throws IOException {
        return JsonParser.parseString(Files.readString(file.toPath(), StandardCharsets.UTF_8)).getAsJsonObject();
    }

    private static String field(JsonObject object, String name) {
        return object.has(name) ? object.get(name).getAsString() : "";
    }
}
